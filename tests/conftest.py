import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# Tiny test models gain nothing from intra-op threads; one thread avoids OpenMP stalls on a busy machine.
torch.set_num_threads(1)
