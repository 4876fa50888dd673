"""`python -m stare_jax.cli`: the `stare-jax` command."""

import sys

from stare_jax.cli import main

sys.exit(main())
