"""Server processes: the one owner of every process autotune starts (``process``)."""
