"""`metrale generate` streams the same text the offline API returns."""

from metrale_jax import LLM, SamplingParams
from metrale_jax.cli import main


def test_generate_streams_greedy_text(capsys):
    assert main(["generate", "--max-tokens", "6", "--temperature", "0", "--max-seq-len", "256",
                 "To be"]) == 0
    printed = capsys.readouterr().out
    expected = LLM(max_seq_len=256).generate(
        "To be", SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text
    assert printed == expected + "\n"


def test_generate_reports_bad_input(capsys):
    assert main(["generate", "--max-tokens", "0", "hello"]) == 2
    assert "max_tokens" in capsys.readouterr().err
