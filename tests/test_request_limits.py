"""The one check of a request against the context (`request.check_context`), made where the
request enters: the prompt must leave room; the server's rule that max_tokens fits too."""

import pytest

from metrale_jax.request import RequestError, check_context


def test_prompt_must_leave_room():
    check_context(63, None, 64, max_tokens_must_fit=True)
    with pytest.raises(RequestError, match="^prompt: .*context length of 64"):
        check_context(64, None, 64, max_tokens_must_fit=False)
    with pytest.raises(RequestError, match="^prompt: is empty"):
        check_context(0, 5, 64, max_tokens_must_fit=False)


def test_max_tokens_must_fit_only_where_asked():
    check_context(60, 100, 64, max_tokens_must_fit=False)  # offline: stops at the context end
    check_context(60, 4, 64, max_tokens_must_fit=True)
    with pytest.raises(RequestError, match="^max_tokens: .*asked for 5 tokens"):
        check_context(60, 5, 64, max_tokens_must_fit=True)
    # A prompt that is itself too long is named as such, not as a max_tokens problem.
    with pytest.raises(RequestError, match="^prompt: "):
        check_context(70, 5, 64, max_tokens_must_fit=True)


def test_logit_bias_entries_within_the_engines_table():
    # Each sequence slot keeps a device table of max_logit_bias entries; a request with more
    # is refused where it enters, never cut or compiled for.
    from metrale_jax.request import SamplingParams

    SamplingParams(logit_bias={i: 1.0 for i in range(8)}).check_against(100, 5, 8, 2)
    with pytest.raises(RequestError, match=r"^logit_bias: 9 entries exceed .*max_logit_bias \(8\)"):
        SamplingParams(logit_bias={i: 1.0 for i in range(9)}).check_against(100, 5, 8, 2)
    # Until min_tokens, the stop token ids and EOS are banned through the same table.
    banned = SamplingParams(logit_bias={i: 1.0 for i in range(6)}, stop_token_ids=[50, 51],
                            min_tokens=3)
    with pytest.raises(RequestError, match="9 entries .*min_tokens"):
        banned.check_against(100, 5, 8, eos_token_id=70)
    banned.check_against(100, 5, 8, eos_token_id=3)  # EOS already among the biased ids
    SamplingParams(logit_bias={i: 1.0 for i in range(6)}, stop_token_ids=[50, 51],
                   min_tokens=3, ignore_eos=True).check_against(100, 5, 8, eos_token_id=70)


def test_top_k_within_the_vocabulary():
    # The step holds top_k as int32: 2**31 and up failed the whole step (found by the fuzzer).
    from metrale_jax.request import SamplingParams

    SamplingParams(top_k=100).check_against(100, 5)
    with pytest.raises(RequestError, match=r"^top_k: 2147483648 exceeds the vocabulary"):
        SamplingParams(top_k=2 ** 31).check_against(100, 5)
