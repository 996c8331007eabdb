"""The main job as one library call: ``run_search``, from the options to the
recommendation and its report.  It sits above ``study``, ``analysis`` and ``report``,
which it drives, so that none of them imports it back."""
