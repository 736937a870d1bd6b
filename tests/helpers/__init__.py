"""What the tests share: tiny data, runs of train.py, files made for a test."""
