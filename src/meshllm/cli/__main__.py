"""``python -m meshllm.cli``: the `mesh-llm` command."""

import sys

from meshllm.cli.main import main

sys.exit(main())
