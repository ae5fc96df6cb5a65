"""Run the visible unit tests (python3 checks/run.py; exit 0 = pass)."""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
suite = unittest.defaultTestLoader.loadTestsFromName("test_inventory")
result = unittest.TextTestRunner(verbosity=1).run(suite)
sys.exit(0 if result.wasSuccessful() else 1)
