# Run by ctest before the tests (a TEST_INCLUDE_FILES script, as gtest_discover_tests's PRE_TEST
# mode is): adds the fast tier of headroom_tests as one CTest test per gtest suite. Starting a test
# process costs about 0.4 s (LibTorch's libraries loaded and its operators registered); most fast
# tests take less than that, and one process per test was about a third of the tier's time.
#
# Set by the file that includes this one (CMakeLists.txt): HEADROOM_TESTS_BINARY, the test
# program; HEADROOM_FAST_EXCLUDED, the gtest filter patterns of the tests that are not fast (their
# own tiers); HEADROOM_FAST_ENVIRONMENT, the tests' environment.
execute_process(COMMAND "${HEADROOM_TESTS_BINARY}" --gtest_list_tests "--gtest_filter=*:-${HEADROOM_FAST_EXCLUDED}"
                OUTPUT_VARIABLE listed ERROR_VARIABLE listed_errors RESULT_VARIABLE listed_rc TIMEOUT 60)
if(NOT listed_rc EQUAL 0)
  # The failure shows as a failing test, with what the program said.
  add_test(fast.listing_failed "${CMAKE_COMMAND}" -E echo "headroom_tests --gtest_list_tests failed (${listed_rc}): ${listed_errors}")
  set_tests_properties(fast.listing_failed PROPERTIES WILL_FAIL TRUE LABELS fast)
  return()
endif()
string(REPLACE "\n" ";" lines "${listed}")
# The fast suites that take ten seconds or more (a cold run's times, 2 cores): started before the
# other fast ones (COST orders a first run), so that the suite does not end on one of them running
# alone while the other core idles (the Cli suite, 66 s, once started among the last).
set(long_suites Cli RealVocabularies/ChunkedLossMatches Planner OomGuard OpCheckpoint Families/EveryFamilyLearns
                HfWeights CachingRun ActivationOffload Checkpointing TrainerMemory)
foreach(line IN LISTS lines)
  # A suite's line is its name and a dot ("Cli.", "RealVocabularies/ChunkedLossMatches.", a typed
  # suite's followed by "  # TypeParam = ..."); its tests' lines are indented.
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.( .*)?$")
    set(suite "${CMAKE_MATCH_1}")
    add_test("${suite}" "${HEADROOM_TESTS_BINARY}" "--gtest_filter=${suite}.*:-${HEADROOM_FAST_EXCLUDED}")
    set_tests_properties("${suite}" PROPERTIES LABELS fast TIMEOUT 600 ENVIRONMENT "${HEADROOM_FAST_ENVIRONMENT}")
    list(FIND long_suites "${suite}" long)  # (no IN_LIST: ctest reads this file without policies set)
    if(long GREATER -1)
      set_tests_properties("${suite}" PROPERTIES COST 25)
    endif()
  endif()
endforeach()
