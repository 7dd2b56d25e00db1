"""Side-by-side measurements: each bench_*.py module has a main() that prints a result table."""
