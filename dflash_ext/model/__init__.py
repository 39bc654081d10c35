"""The drafter as a model: its config and the rules of each config.json field (:mod:`.config`,
:mod:`.config_fields`), its checkpoint files (:mod:`.checkpoint`), its layers and masks
(:mod:`.layers`, :mod:`.masks`), the drafter itself, a plain ``nn.Module`` of weights and the
training forward (:mod:`.drafter`), and the pretrained models: the embedded default target
and the drafter shipped for it (:mod:`.pretrained`). Imports only :mod:`dflash_ext.ops`."""
