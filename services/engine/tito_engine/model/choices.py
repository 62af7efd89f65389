"""What each new choice gets from the model side: the random generator of a seeded request's
choice and the grammar matcher of a constrained one. The scheduler asks for them (its `ChoiceState`
protocol) so that scheduling imports neither torch nor xgrammar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tito_engine.model import constraints
from tito_engine.model.sampler import ChoiceGenerator, make_generator


class ModelChoiceState:
    """Generators on the model's device; matchers from the compiled grammar."""

    def __init__(self, device: torch.device | str):
        self.device = device

    def new_generator(self, seed: int, index: int) -> ChoiceGenerator:
        return make_generator(seed, index, self.device)

    def new_matcher(self, grammar: Any, prior_output: Sequence[int] = ()) -> Any:
        return constraints.new_matcher(grammar, prior_output)
