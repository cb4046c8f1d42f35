import os
import sys

# Tests import shared helpers from each other (e.g. test_model's tiny config).
sys.path.insert(0, os.path.dirname(__file__))
