"""The llama.cpp host (through `llama-cpp-python`, the `llama` extra).

`LlamaHost` (host.py) executes plans; it is made of small parts that own their state:
`Lanes` and `KvCells` (lanes.py), `Samplers` (samplers.py), `PrefixHolders` (holders.py),
`Tokenizer` (tokenizer.py); `RowRunner` (rows.py) and `DirectRows` (direct.py) run rows over
them. backend.py holds llama.cpp's process-wide setup and log.
"""
from .backend import LlamaLoadError, recent_log
from .holders import PrefixHolders
from .host import LlamaHost
from .lanes import KvCells, Lanes
from .samplers import SamplerChain, Samplers
from .tokenizer import Tokenizer

__all__ = ["KvCells", "Lanes", "LlamaHost", "LlamaLoadError", "PrefixHolders", "SamplerChain",
           "Samplers", "Tokenizer", "recent_log"]
