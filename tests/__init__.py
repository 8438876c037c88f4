"""jaxmp's tests (a package: tests.<folder>.test_x, so basenames may repeat)."""
