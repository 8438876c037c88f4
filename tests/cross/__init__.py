"""Cross-cutting suites: reliability, bad inputs, strict promotion, efficiency, API surface, layering."""
