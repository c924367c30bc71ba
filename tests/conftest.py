import os
import sys

# Spin-waiting OpenMP threads slow everything down on a small shared machine; must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
