"""Hand-offs to distributed engines: verl 0.9.x (:mod:`.verl`, :mod:`.verl_mapping`) and OpenRLHF 0.11.x
(:mod:`.openrlhf`, :mod:`.openrlhf_mapping`), written by :func:`write_handoff` from what they share (:mod:`.common`,
:mod:`.shared_keys`, the launch scripts' :mod:`.launch`)."""

from lorarl.export.engines.common import Applied, Derived, Engine, HandOff, KeyMap, Mapping, Unmapped, mapping_yaml
from lorarl.export.engines.handoff import ENGINES, write_handoff
from lorarl.export.engines.launch import Script
from lorarl.export.engines.launch import render as launch_script
from lorarl.export.engines.openrlhf_mapping import openrlhf_mapping
from lorarl.export.engines.verl_mapping import verl_mapping

__all__ = [
    "ENGINES",
    "Applied",
    "Derived",
    "Engine",
    "HandOff",
    "KeyMap",
    "Mapping",
    "Script",
    "Unmapped",
    "launch_script",
    "mapping_yaml",
    "openrlhf_mapping",
    "verl_mapping",
    "write_handoff",
]
