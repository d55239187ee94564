"""Run at start-up by every process the tests spawn (conftest.py puts this folder on their PYTHONPATH):
torch is a test dependency only (the reference for embeddings), and a user's install of mlxd has none.
transformers imports torch whenever it is installed, some 2 s per process; marked absent here, as it is
for a user, ``import torch`` fails and ``importlib.util.find_spec("torch")`` answers None."""

import sys

sys.modules["torch"] = None
