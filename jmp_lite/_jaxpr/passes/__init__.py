"""One module per pass over a traced function (see `jmp_lite._jaxpr`)."""
