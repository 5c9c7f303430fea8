import os

import torch

# One thread in the test process too: the single-process reference then runs the same kernels
# as the one-thread workers, and tests do not fight the workers for the two cores.
torch.set_num_threads(1)
os.environ.setdefault("PARATRAIN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "paratrain-tests"))
# --compile auto (the default) never measures in the suite: a run of 50+ steps (the progress and
# failure tests) would otherwise compile a block with inductor, minutes on 2 cores. The tests of
# auto itself (test_compile_auto.py) lift this.
os.environ.setdefault("PARATRAIN_COMPILE_AUTO", "off")
