"""The proposers, by the name requests and the `proposers` parameter use.

To add one: a module in this package with a `Proposer` subclass (base.py), and a line here.
"""

from __future__ import annotations

from specdec.loop.proposers.base import Proposer
from specdec.loop.proposers.draft_model import DraftModelProposer
from specdec.loop.proposers.grammar import GrammarProposer
from specdec.loop.proposers.ngram import NgramProposer
from specdec.loop.proposers.suffix import SuffixProposer

REGISTRY: dict[str, type[Proposer]] = {
    DraftModelProposer.name: DraftModelProposer,
    NgramProposer.name: NgramProposer,
    SuffixProposer.name: SuffixProposer,
    GrammarProposer.name: GrammarProposer,
}
# Those a server runs unless PROPOSERS says otherwise, in order of preference (a fixed k
# goes to the first). Not suffix: beside the other two it gained beyond the noise floor on
# one workload and level and lost on another (docs/benchmarks.md, "The suffix proposer").
# The grammar proposes only for guided rows, what their grammar forces.
PROPOSERS = (DraftModelProposer.name, NgramProposer.name, GrammarProposer.name)
