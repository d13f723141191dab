"""tools/aot_thunks.py's reading of XLA's thunk sequence (the compile itself needs jax's CUDA plugin,
which CI does not install; the summary is what the kernel notes quote)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "aot_thunks", Path(__file__).resolve().parents[1] / "tools" / "aot_thunks.py")
aot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aot)

# The format of `*.thunk_sequence_after_thunk_passes.txt` (jax 0.11.2's XLA), cut down: a command buffer
# before a while loop whose body runs an async copy, a dynamic-slice fusion around a cuBLAS call, and a
# second command buffer.
SAMPLE = """\
000: kCommandBuffer [source       | next=003 (1)] 
    001: kCopy [source | sink] kCopy
    002: kCustomKernel [source | sink] loop_pad_fusion grid: [4, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
003: kWhile         [prev=000 (1) | sink        ]   
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    005: kAsyncStart         [source       | next=009 (2)] stream=computation_stream[1], async_id=5
        007: kDynamicSliceFusion [source | sink] params=1, results=1
            006: kCopy [source | sink] kCopy
    008: kAsyncDone          [source       | sink        ] async_id=5
    009: kDynamicSliceFusion [prev=005 (2) | next=000 (1)] params=2, results=2
        010: kCublasLtMatmul [source | sink] kCublasLtMatmul
    000: kCommandBuffer      [prev=009 (1) | sink        ] 
        011: kCustomKernel [source       | next=012 (1)] fusion_60 grid: [144, 1, 1] threads: [128, 1, 1]  shared_memory: 32 bytes
        012: kCustomCall   [prev=011 (1) | next=013 (1)] kCustomCall
        013: kCustomKernel [prev=012 (1) | sink        ] dense_decode grid: [32, 3, 3] threads: [128, 1, 1]  shared_memory: 71680 bytes
"""


def test_summary_counts_command_buffers_and_what_runs_outside(tmp_path):
    path = tmp_path / "m.thunk_sequence_after_thunk_passes.txt"
    path.write_text(SAMPLE)
    text = aot._summary(path)
    assert "command buffers: 2 (thunks directly inside each: [2, 3])" in text
    outside = {line.split(None, 1)[1]: int(line.split()[0]) for line in text.splitlines()[2:]}
    assert outside == {"kWhile": 1, "kCustomKernel loop_compare_fusion": 1, "kAsyncStart stream=computation_stream[1], "
                       "async_id=5": 1, "kDynamicSliceFusion params=1, results=1": 1, "kCopy kCopy": 1,
                       "kAsyncDone async_id=5": 1, "kDynamicSliceFusion params=2, results=2": 1,
                       "kCublasLtMatmul kCublasLtMatmul": 1}


def test_options_parse_as_xla_debug_option_values():
    assert aot._option("xla_gpu_graph_min_graph_size=1") == ("xla_gpu_graph_min_graph_size", 1)
    assert aot._option("--xla_gpu_enable_cublaslt=false") == ("xla_gpu_enable_cublaslt", False)
    assert aot._option("xla_gpu_enable_command_buffer=FUSION,CUBLAS") == ("xla_gpu_enable_command_buffer",
                                                                          "FUSION,CUBLAS")


def test_summarize_prints_the_summary_of_given_dumps_without_compiling(tmp_path, monkeypatch, capsys):
    """`--summarize FILE...` (what the device stages run on the GPU's own dumps): each file's summary
    under its name, and no jax import or compile (the function returns before either)."""
    path = tmp_path / "m.thunk_sequence_after_thunk_passes.txt"
    path.write_text(SAMPLE)
    monkeypatch.setattr("sys.argv", ["aot_thunks.py", "--summarize", str(path)])
    aot.main()
    assert capsys.readouterr().out == f"== {path.name}\n{aot._summary(path)}\n"
