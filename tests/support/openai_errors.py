"""What the official `openai` client sees of a refusal."""

from __future__ import annotations

from typing import Any

import openai
import pytest


def refused_param(call: Any, **kwargs: Any) -> str | None:
    """The `param` of the 400 that `call(**kwargs)` must get, checked to be in OpenAI's error shape."""
    with pytest.raises(openai.BadRequestError) as refused:
        call(**kwargs)
    assert refused.value.status_code == 400
    body: Any = refused.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    return body["param"]
