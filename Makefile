# headroom's two entry points (see README): `make run` and `make test`. Both install what they need.
# `make check` is the fast tier of the tests (CTest label fast), for the edit-build-test loop.
BUILD ?= build
JOBS ?= $(shell nproc)
# Tests: one more than the cores, since the ranks of the distributed tests wait on each other and
# on their launcher, and a third test fills those waits (docs/testing.md).
TEST_JOBS ?= $(shell echo $$(( $$(nproc) + 1 )))

.PHONY: setup configure build run test check bench clean

setup:
	@bash scripts/setup >/dev/null

configure: setup
	@mkdir -p $(BUILD)
	@cmake -S . -B $(BUILD) -G Ninja > $(BUILD)/cmake.log 2>&1 || (cat $(BUILD)/cmake.log; exit 1)

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/headroom doctor --report $(BUILD)/doctor.html

test: build
	cd $(BUILD) && ctest -j $(TEST_JOBS) --output-on-failure

check: build
	cd $(BUILD) && ctest -j $(TEST_JOBS) --output-on-failure -L '^fast$$'

bench: build
	@for b in $(BUILD)/bench_*; do echo "== $$b"; $$b; done

clean:
	rm -rf $(BUILD)
