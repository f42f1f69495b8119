"""Command-line flags that commands on several layers share; here, below all of them, so that no
command module imports the top-level `dspark.cli`."""

import argparse


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """`--dtype` for every command that loads a target."""
    from dspark.loading import DTYPE_NAMES

    parser.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                        help="target dtype (default auto: bfloat16 on CPUs with native bf16 (AVX512-BF16/AMX) and on "
                             "CUDA GPUs that support it, else float32)")


def add_draft_gate_arg(parser: argparse.ArgumentParser) -> None:
    """`--draft-gate / --no-draft-gate` for every command that runs the engine with a dspark scheduler."""
    parser.add_argument("--draft-gate", action=argparse.BooleanOptionalAction, default=None,
                        help="skip drafting in rounds where the engine measured plain decoding faster (default: on "
                             "for the dspark schedulers; seeded sampled requests always follow the scheduler)")


def add_compile_arg(parser: argparse.ArgumentParser) -> None:
    """`--compile` for the commands that decode with the engine."""
    parser.add_argument("--compile", action="store_true",
                        help="run the target's decode and verify steps torch.compile'd (Llama-family targets; about a "
                             "minute of compiling per graph once per process, then faster steps on a CPU)")
