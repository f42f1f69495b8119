"""OpenAI request bodies (the subset we serve) and the OpenAI error schema.

Every numeric field is range-checked and every string must be valid UTF-8 (JSON can carry lone
surrogates such as "\\ud800", which no tokenizer can encode), so a bad value is a 400 naming the field,
never a failure deep in the engine. Bounds that a server operator sets (messages, stop strings, prompt
and completion tokens) are checked against `ServerLimits` by the handlers.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from dspark.sampling import SamplingParams

#: temperatures below this are greedy decoding (as in vLLM): dividing logits by ~1e-40 overflows to inf
MIN_TEMPERATURE = 1e-5
MAX_INT32 = 2**31 - 1


def _valid_utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid UTF-8 (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_utf8)]


class APIError(Exception):
    """An error with its HTTP status, rendered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, le=MAX_INT32)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    user: Text | None = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if s]

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters; a temperature below MIN_TEMPERATURE is greedy, top_k -1 is off."""
        temperature = self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0
        return SamplingParams(temperature, max(self.top_k, 0), self.top_p)

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported: send one request per completion", param="n")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("logprobs", "top_logprobs"):
            if getattr(self, name):
                raise APIError(400, f"{name} are not supported", param=name)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[Annotated[int, Field(ge=0, le=MAX_INT32)]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: Text | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", param=name)

    def token_limit(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions
