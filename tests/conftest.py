import os
import sys

# hf_reference.py sits beside the tests; the package under test is the installed one.
sys.path.insert(0, os.path.dirname(__file__))
