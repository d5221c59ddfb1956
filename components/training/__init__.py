"""Lightning glue: data module, training module, callbacks, loggers, checkpoint I/O."""
