"""Real training through aggd: a small MLP on scikit-learn's digits, data-parallel over the lab.

* :mod:`.model` -- the MLP in numpy, parameters in one flat float32 vector;
* :mod:`.data` -- the digits data set (shipped with scikit-learn), split and sharded per rank;
* :mod:`.loop` -- the training loop, right under every strategy (and gloo for the baseline);
* :mod:`.worker` -- one worker process (``python -m aggd.training.worker``);
* :mod:`.labtrain` -- a daemon and N workers in a lab: runs, scenarios, time to accuracy
  (``aggctl bench stragglers``, ``aggctl demo``);
* :mod:`.torch_models`, :mod:`.torch_train`, :mod:`.torchlab`, :mod:`.torchbench` -- PyTorch models
  trained with DDP under torchrun in a lab, through aggd or gloo (``aggctl bench train``).
"""
