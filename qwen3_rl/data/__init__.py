"""Data preparation (``prepare``: downloaded files -> verl parquet) and answer verification (``reward``)."""
