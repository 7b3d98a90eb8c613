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
