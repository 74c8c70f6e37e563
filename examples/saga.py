"""``ctx.saga`` with ``compensate=``: book a trip, undo the bookings if payment fails.

Each booking step names the function that undoes it. When an exception leaves the
``ctx.saga`` block, the compensations of the steps completed in it run newest first
(the hotel is cancelled before the flight), each a durable step with retries that runs
exactly once even across a crash, and then ``RolledBack`` is raised with the exception
as its ``cause``. Pay with card ``"4242"`` and the trip is booked.
"""

from __future__ import annotations

from stepstream import Context, NonRetryableError, RolledBack, StepFailed, workflow


def book_flight(destination: str) -> str:
    return f"flight-{destination}"


def book_hotel(destination: str) -> str:
    return f"hotel-{destination}"


def cancel_booking(booking: str) -> str:  # called with the result of the step it undoes
    return f"cancelled {booking}"


def charge(card: str) -> str:
    if card == "declined":
        raise NonRetryableError("card declined by the issuer")
    return f"charged {card}"


@workflow("saga")
async def trip(ctx: Context, order: dict[str, str]) -> dict[str, object]:
    try:
        async with ctx.saga("booking"):
            flight = await ctx.step("flight", book_flight, order["to"], compensate=cancel_booking)
            hotel = await ctx.step("hotel", book_hotel, order["to"], compensate=cancel_booking)
            await ctx.step("pay", charge, order["card"])
    except RolledBack as exc:  # the bookings are undone; exc.cause is why
        cause = exc.cause
        return {
            "booked": False,
            "why": cause.error_message if isinstance(cause, StepFailed) else str(cause),
        }
    return {"booked": True, "flight": flight, "hotel": hotel}
