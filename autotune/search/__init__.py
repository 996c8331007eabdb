"""Each command as one library call with its typed, frozen options: ``run_search``
(the search, from the options to the recommendation and its report), ``run_ceiling``,
``run_bench`` and ``run_sweep_command``.  It sits above ``study``, ``analysis`` and
``report``, which it drives, so that none of them imports it back."""
