"""Model code from public repositories, vendored verbatim (each file's header names its source and version)."""
