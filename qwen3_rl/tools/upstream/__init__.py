"""Upstream source trees: download (git or PyPI), patch series, build steps."""
