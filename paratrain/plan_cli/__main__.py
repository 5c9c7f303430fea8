"""``python -m paratrain.plan_cli``: the same as ``paratrain plan``."""

import sys

from paratrain.plan_cli import main

sys.exit(main())
