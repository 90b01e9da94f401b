"""Constants the staged-serving tests share (importable: conftest modules are not)."""
from skippy_scheduler.hosts.tiny_model import TinyModelShape

N_SEQ = 8
MAX_GEN = 10
SHAPE = TinyModelShape(n_layer=4)

