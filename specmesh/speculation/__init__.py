"""The speculation step, written once: the loop, the in-process engine, and the policies that plan each step
(expertise routing, the request classifier, goodput control)."""
