// Command chaos runs a job of fixed work through a seeded schedule of
// failures and reports its goodput.
package main

func main() {}
