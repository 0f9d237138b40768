"""The speculation step, written once: the engine core (one step loop for every running request), the
in-process engine, and the policies that plan each step (expertise routing, the request classifier, goodput
control)."""
