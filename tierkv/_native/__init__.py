"""Native code of tierkv: C sources built at install time (see setup.py), loaded with ctypes."""
