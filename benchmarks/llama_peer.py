"""Run the llama.cpp peer (../shared/peers/bench_llama.py, same arguments) with llama.cpp's extra
weight buffers off (`use_extra_bufts`: the AMX and repacked-weight layouts).

On the Intel Xeon machines with AMX, llama-cpp-python 0.3.36 ends without a result on quantized GGUFs
(Q8_0, Q4_1: a segfault in those buffers); with them off the same build runs its plain CPU kernels
and gives Q8_0 / Q4_1 figures. F32 weights never use those buffers, so their figures do not move.
Usage: PEERS_SRC=../shared/peers <llama venv>/bin/python benchmarks/llama_peer.py --workload w2 --gguf F
"""

import os
import runpy
import sys

from llama_cpp import llama_cpp as L

_defaults = L.llama_model_default_params


def _without_extra_buffers():
    params = _defaults()
    params.use_extra_bufts = False
    return params


L.llama_model_default_params = _without_extra_buffers
script = os.path.join(os.environ.get("PEERS_SRC", "../shared/peers"), "bench_llama.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
