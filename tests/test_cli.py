"""`metrale generate` streams the same text the offline API returns."""

from metrale_jax import LLM, SamplingParams
from metrale_jax.cli import main


def test_generate_streams_greedy_text(capsys):
    assert main(["generate", "--max-tokens", "6", "--temperature", "0", "--max-seq-len", "256",
                 "To be"]) == 0
    printed = capsys.readouterr().out
    expected = LLM(max_seq_len=256, warmup=False).generate(
        "To be", SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text
    assert printed == expected + "\n"


def test_generate_reports_bad_input(capsys):
    assert main(["generate", "--max-tokens", "0", "hello"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_serve_ladders_pad_decode_rows_finely_and_prefill_rows_coarsely():
    from metrale_jax.cli import build_parser
    from metrale_jax.config import EngineConfig
    from metrale_jax.runner.buckets import BucketLadders
    from server.serve import engine_kwargs

    kwargs = engine_kwargs(build_parser().parse_args(["serve", "--max-batch-size", "48"]))
    ladders = BucketLadders.from_config(EngineConfig(**kwargs))
    assert ladders.rows == (1, 2, 4, 8, 16, 32, 48) and ladders.prefill_rows == (8, 48)
    # 17 decoding sequences pad to 32 rows, not to the whole batch ...
    assert ladders.shape_for(17, 17, 1, 4).rows == 32
    # ... while a step that carries a prefill chunk uses the coarse ladder.
    mixed = ladders.shape_for(17 + 100, 18, 100, 4)
    assert (mixed.rows, mixed.query_len, mixed.tokens) == (48, 128, 128)
    over = engine_kwargs(build_parser().parse_args(["serve", "--prefill-seq-buckets", "4,64"]))
    assert over["prefill_seq_buckets"] == (4, 64)


def test_serve_takes_a_tensor_parallel_size():
    from metrale_jax.cli import build_parser
    from server.serve import engine_kwargs

    assert engine_kwargs(build_parser().parse_args(["serve"]))["parallel"].tp == 1
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    assert engine_kwargs(args)["parallel"].tp == 2


def test_serve_speculates_where_the_model_can_unless_told_not_to():
    """`metrale serve` defaults to MTP with the gate on auto (on a model without MTP
    modules "auto" serves plain); "none" turns it off."""
    from metrale_jax.cli import build_parser
    from server.serve import speculative_arg

    assert speculative_arg(build_parser().parse_args(["serve"])) == "auto"
    for off in ("none", "off"):
        args = build_parser().parse_args(["serve", "--speculative-config", off])
        assert speculative_arg(args) is None
