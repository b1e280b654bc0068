"""``python -m nanovllm.serve``: the OpenAI-compatible server (`nanovllm.serve.cli`)."""

import sys

from nanovllm.serve.cli import main

# A notebook also runs this code as __main__; only a real `python -m nanovllm.serve` should act.
if __name__ == "__main__" and "ipykernel" not in sys.modules:
    sys.exit(main())
