"""What a reward reads: the model's own turns and the observations, told apart by the loss
mask, never by parsing the text.

A multi-turn trajectory's response interleaves what the model generated (loss mask 1) with
what its tools answered (loss mask 0). A tool's output is whatever the model's code
printed, so a reward that looked for the answer in the decoded text could be handed it by
the tool (``print(r"\\boxed{42}")``), and one that cut observations out by their tags could
be fooled by a printed closing tag. :func:`response_of` splits the token ids along the mask
instead: the :class:`Response` a reward gets *is* the model's text, with the observations
beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from laminar_core.types import Trajectory


@dataclass(frozen=True)
class Segment:
    """A run of the response: the model's own tokens (``by_model``) or an observation."""

    text: str
    by_model: bool


class Response(str):
    """The response as a reward reads it.

    As a ``str`` it is **the model's own text**: its turns in order, joined by a newline
    where observations stood (a single-turn response is exactly its decoded text). The
    structure is beside it: ``turns`` (the model's turns), ``observations`` (what tools
    answered, as the model saw them), ``segments`` (both, in order) and ``transcript`` (the
    whole response as the model's context held it). Built by :func:`response_of`.
    """

    segments: tuple[Segment, ...]

    def __new__(cls, segments: tuple[Segment, ...] | list[Segment] = ()) -> Response:
        segments = tuple(segments)
        self = super().__new__(cls, "\n".join(s.text for s in segments if s.by_model))
        self.segments = segments
        return self

    @property
    def turns(self) -> tuple[str, ...]:
        """The model's turns, in order."""
        return tuple(s.text for s in self.segments if s.by_model)

    @property
    def observations(self) -> tuple[str, ...]:
        """The observations (tool output as the parser rendered it), in order."""
        return tuple(s.text for s in self.segments if not s.by_model)

    @property
    def transcript(self) -> str:
        """Everything, model turns and observations, as one text."""
        return "".join(s.text for s in self.segments)

    def __reduce__(self):  # a str subclass with state: pickle (Ray) must keep the segments
        return (Response, (self.segments,))


def model_turns(response: str) -> tuple[str, ...]:
    """``response.turns`` of a :class:`Response`; a plain string is one turn."""
    return response.turns if isinstance(response, Response) else (response,)


def response_of(traj: Trajectory, decode: Callable[[list[int]], str]) -> Response:
    """``traj``'s response split along its loss mask: runs of 1s are the model's turns, runs
    of 0s observations, each decoded on its own with ``decode`` (special tokens skipped, so
    control tokens of the chat template's markup are not in the text; a tool's output was
    tokenised as plain text, so what it printed is). No ids: an empty response."""
    ids = list(traj.response_ids)
    mask = traj.response_mask()
    mask = mask[: len(ids)] + [1] * (len(ids) - len(mask))
    segments: list[Segment] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            segments.append(Segment(decode(ids[start:i]), bool(mask[start])))
            start = i
    return Response(segments)
