# pytester drives inner pytest runs in tests/testing/test_pytest_plugin.py.
pytest_plugins = ["pytester"]
