"""The doctor's shared model, below every stage: the evidence the readers fill
(:mod:`~doctor.model.evidence`, gathered per rank by :mod:`~doctor.model.builder`), how a stack
frame is classified (:mod:`~doctor.model.frames`), and what the rank analysis finds
(:mod:`~doctor.model.findings`). The stages run in order and import only this model and the
stages before them: ``read`` -> ``ranks`` -> ``facts`` -> ``report``."""
