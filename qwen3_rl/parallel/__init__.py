"""Parallelism planning: HDP (hybrid data / context parallel) sequence assignment."""
