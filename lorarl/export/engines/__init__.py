"""Hand-offs to distributed engines: verl (:mod:`.verl`) and OpenRLHF (:mod:`.openrlhf`), written by
:func:`write_handoff` from what they share (:mod:`.common`)."""

from lorarl.export.engines.common import Engine, HandOff, KeyMap, Unmapped, launch_script, mapping_yaml
from lorarl.export.engines.handoff import ENGINES, write_handoff
from lorarl.export.engines.openrlhf import openrlhf_mapping
from lorarl.export.engines.verl import verl_mapping

__all__ = [
    "ENGINES",
    "Engine",
    "HandOff",
    "KeyMap",
    "Unmapped",
    "launch_script",
    "mapping_yaml",
    "openrlhf_mapping",
    "verl_mapping",
    "write_handoff",
]
