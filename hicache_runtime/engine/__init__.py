"""One rank's work: the model, the scheduler, the workload, the objects a rank is built from
(``rank``) and the step loops."""
