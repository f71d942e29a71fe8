import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# Tiny test models gain nothing from intra-op threads; one thread avoids OpenMP stalls on a busy machine.
torch.set_num_threads(1)
# The CLI compiles the decoder unless told not to; tests run eagerly except where they test compilation.
os.environ.setdefault("SPECULANT_COMPILE", "0")
