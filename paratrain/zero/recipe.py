"""The user's optimizer, rebuilt on ZeRO's flat shards: its class, its param groups, their settings.

ZeRO steps a rank's slice of a flat buffer instead of whole parameters. That gives the same
numbers as stepping the whole tensors exactly when the optimizer is *element-wise*: every element's
update depends only on that element's gradient, state and the group's hyper-parameters (plus
per-parameter scalars such as the step count, which are the same for every slice). SGD, Adam,
AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, ASGD, Adadelta and Rprop are; LBFGS (a line search
over the whole model), Adafactor (row/column factored moments), Muon (orthogonalised matrices) and
SparseAdam (sparse gradients) are not.

A recipe records the class and every param group's hyper-parameters; ``build`` constructs the same
class over the pieces of a master shard (one group per piece, carrying the settings of the user's
group the piece was cut from), and ``refresh`` copies the user's current settings in before each
step, so an LR scheduler that writes ``param_groups[i]["lr"]`` keeps working.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

from paratrain.optim import adamw8bit as a8

#: Classes whose update is element-wise (checked one by one against torch's implementations).
ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Adadelta,
    torch.optim.Rprop,
)


class NotElementwiseError(ValueError):
    """ZeRO was asked to shard an optimizer whose update may mix elements."""


def check_elementwise(optimizer: torch.optim.Optimizer, *, allow_non_elementwise: bool = False) -> None:
    """Refuse (with the reason) a class not known to be element-wise, unless the user vouches for it.

    The exact class is checked, not subclasses: a subclass may override ``step``.
    """
    if allow_non_elementwise or type(optimizer) in ELEMENTWISE:
        return
    known = ", ".join(c.__name__ for c in ELEMENTWISE)
    raise NotElementwiseError(
        f"ZeRO shards every parameter across the data-parallel ranks and steps each slice on its own; "
        f"{type(optimizer).__name__} is not known to be element-wise (an element's update may depend on "
        f"other elements, as in LBFGS, Adafactor or Muon), so the sharded step could differ from the "
        f"unsharded one. Use zero=0, an element-wise optimizer ({known}), or pass "
        f"allow_non_elementwise=True to Parallel if you know its update is element-wise.")


@dataclass
class OptimizerRecipe:
    cls: type
    groups: list[dict]  # hyper-parameters of each of the user's param groups ("params" left out)
    ctor_kwargs: dict  # constructor arguments the class needs beyond the groups (its defaults)

    #: Pieces carry their group index; the group's own settings hold any weight decay.
    weight_decay = 0.0
    #: The rest of base.strategy.OptimizerSettings, for ZeRO's stores: the user's class is never
    #: paratrain's 8-bit AdamW store (its own class steps the fp32 shards).
    name = "recipe"
    block_size = a8.BLOCK_SIZE
    min_8bit_size = a8.MIN_8BIT_SIZE

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerRecipe:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        accepted = inspect.signature(type(optimizer).__init__).parameters
        ctor = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return cls(type(optimizer), groups, ctor)

    def build(self, params: list[nn.Parameter], group_index: list[int]) -> torch.optim.Optimizer:
        """The user's class over ``params``, each in a group of its own with group_index's settings."""
        groups = [{"params": [p], **self.groups[g]} for p, g in zip(params, group_index)]
        return self.cls(groups, **self.ctor_kwargs)

    def refresh(self, user_groups: list[dict]) -> None:
        """Take the user's current settings (a scheduler may have changed lr, momentum, ...)."""
        for mine, theirs in zip(self.groups, user_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    def apply(self, optimizer: torch.optim.Optimizer, group_index: list[int]) -> None:
        for group, g in zip(optimizer.param_groups, group_index):
            group.update(self.groups[g])

    def state_keys(self, group: int) -> list[str]:
        """Per-element state the class keeps for ``group``, learnt by stepping a probe twice
        (lazily created state such as SGD's momentum buffer appears only after a step)."""
        probe = nn.Parameter(torch.zeros(2))
        opt = self.build([probe], [group])
        for _ in range(2):
            probe.grad = torch.ones(2)
            opt.step()
        return sorted(k for k, v in opt.state[probe].items() if torch.is_tensor(v) and v.shape == probe.shape)
