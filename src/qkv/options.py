"""The choices and defaults that the command line shows, defined once, here, in a module that imports nothing:
``qkv --help`` (and ``qkv COMMAND --help``) builds its parser from them without loading torch, which takes
seconds. The modules that act on them (:mod:`qkv.device`, :mod:`qkv.quantize`, :mod:`qkv.tasks.demo`, ...)
import them from here; ``tests/test_cli_help.py`` checks that the help stays free of torch.
"""

# qkv.device: --device and --precision
DEVICES = "auto, cpu, cuda or cuda:N"
PRECISIONS = ("auto", "fp32", "bf16", "fp16")

# qkv.quantize: --quantize and --group-size
MODES = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's int4 kernel takes
DEFAULT_GROUP_SIZE = 32

# qkv.explore: ``qkv explore --new-tokens``
NEW_TOKENS = 16  # how far a language model continues the input

# qkv.tasks.demo: ``qkv demo --steps``
STEPS = 900
"""The demo's training budget in optimizer steps: enough for >= 99% exact match on the test pairs (measured:
see :mod:`qkv.tasks.demo`)."""

STEPS_MINUTES = "2-4"
"""About how many minutes the demo takes on two quiet CPU cores, as ``qkv demo --help`` says it: a range, since
the time depends on the CPU (docs/demo.md records the measured runs with their machine)."""
