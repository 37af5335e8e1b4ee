// The headers under test are compiled in translation units of their own, linked here: a
// function defined in a header without `inline` fails to link, as it would in a user's program.
int main() {
  return 0;
}
