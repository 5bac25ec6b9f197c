"""Benchmarks: per-layer (bench) and whole-model (bench_cases, bench_model) GPU timings; no CLI code."""
